"""Placement config and launch plans, shared by every launcher plugin."""

"""The trainer role."""

"""The SFT role."""

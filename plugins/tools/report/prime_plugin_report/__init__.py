"""prime-plugin-report: ``prime report OUTPUT_DIR`` (see README.md)."""

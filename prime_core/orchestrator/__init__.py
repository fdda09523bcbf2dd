"""The orchestrator role."""

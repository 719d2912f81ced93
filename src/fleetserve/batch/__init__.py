"""Batch jobs: OpenAI's Batch API store and runner, and `fleetserve batch run`."""

"""Scheduler service: the client entry point; routes requests to verifiers by load, keeps state in a store."""

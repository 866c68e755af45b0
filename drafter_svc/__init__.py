"""Drafter service: one drafter checkpoint served to many verifiers over DraftStream."""

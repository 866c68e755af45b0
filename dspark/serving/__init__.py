"""What the three gRPC services share: server boilerplate, flags, request validation, metrics.

The services themselves (verifier_svc, drafter_svc, scheduler_svc) are thin shells over dspark/;
this package keeps their common plumbing in one place instead of three copies.
"""

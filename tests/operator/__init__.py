"""Operator tests: kopf against the Kubernetes emulator, Redis and Prometheus."""

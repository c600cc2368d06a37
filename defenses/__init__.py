"""Defenses: TLS certificates for deployment, encryption at rest of stored uploads (and DP-SGD)."""

"""Flower Message-API apps for EFTViT and the Fed-Full reference; the same apps run in simulation and deployment."""

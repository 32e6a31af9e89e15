"""infra/train package."""

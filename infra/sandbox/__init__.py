"""infra/sandbox package."""

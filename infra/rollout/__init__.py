"""infra/rollout package."""

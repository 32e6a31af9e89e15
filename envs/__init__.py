"""envs package."""

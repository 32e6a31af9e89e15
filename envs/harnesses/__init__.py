"""Third-party agent harnesses, run unmodified in their own virtual environments behind the gateway."""

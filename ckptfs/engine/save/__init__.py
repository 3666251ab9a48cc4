"""The save: one pipeline (plan, stage, write, commit) with hook points, its phases, the
health checks and the save lock."""

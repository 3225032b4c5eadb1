"""A script that launches gpc and makes no collective (a dry-run sweep of it must pass)."""

from parallelctx import gpc, launch_from_torch

launch_from_torch({"parallel": {"tensor": 2}})
gpc.destroy()

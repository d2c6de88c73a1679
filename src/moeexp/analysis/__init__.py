"""Studies of routing traces that sit above the simulator (they replay through it)."""

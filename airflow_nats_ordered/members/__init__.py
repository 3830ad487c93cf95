"""What runs a group member outside the core: its handler loaded by name, its metrics endpoint."""

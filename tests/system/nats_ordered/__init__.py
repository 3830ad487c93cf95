"""System tests: the example DAGs the how-to pages in docs/howto/ quote."""

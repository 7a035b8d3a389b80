"""torchtitan integration: the ACCO trainer, its ``[acco]`` config section and helpers."""

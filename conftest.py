# Makes the top-level modules (band.py, grpo.py, ...) importable from tests/ and derivations/.

"""The rank's continuous-batching scheduler and the owners it hands work to (see ``scheduler.py``).

Imports nothing itself: the simulator reads the pure ``policy`` module without pulling in torch.
"""

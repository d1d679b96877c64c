"""bfexp's Hydra launcher plugin for Slurm sweeps (hydra/launcher=slurm); see bfexp/launchers/slurm_sweep.py."""

"""bfexp's Slurm sweep launcher as a Hydra plugin (Hydra instantiates launchers from
hydra_plugins only); the work is in bfexp/launchers/slurm_sweep.py, which imports nothing back."""

from __future__ import annotations

from typing import Any, Sequence

from hydra.core.utils import JobReturn
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher


class SlurmSweepLauncher(SlurmLauncher):
    """One Slurm job per sweep point, each with the resources its own ranks need."""

    runs_here = False  # each job on the machines of its own allocation (bfexp.launchers.sweep)

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from bfexp.launchers import slurm_sweep

        return slurm_sweep.launch(self, job_overrides, initial_job_idx)

    def __call__(self, config: Any, singleton_state: dict[Any, Any]) -> JobReturn:  # type: ignore[override]
        from bfexp.launchers import slurm_sweep

        return slurm_sweep.run_in_job(self, config, singleton_state)

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        """A preempted job is not resubmitted: its ranks would start over."""
        return None


def register_plugin() -> None:
    """Make the launcher plugin known to Hydra: an editable install (pip install -e) maps
    hydra_plugins/bfexp_slurm_launcher in a way Hydra's scan of hydra_plugins does not see."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(SlurmSweepLauncher)

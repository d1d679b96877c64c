"""How a job's process ranks start: one component per back end (bfexp.launchers.base says what each
answers). conf/launcher/<name>.yaml names its class with ``_target_``; a user's own launcher (PBS, LSF,
a site's wrapper) is one class and one YAML of theirs."""

from bfexp.launchers import emulated, srun
from bfexp.launchers.base import TIMEOUT_VARIABLE, Launcher, find_mpiexec, processor_slots
from bfexp.launchers.emulated import Emulated
from bfexp.launchers.local import Local
from bfexp.launchers.mpirun import Mpirun
from bfexp.launchers.srun import Srun

__all__ = ["TIMEOUT_VARIABLE", "Emulated", "Launcher", "Local", "Mpirun", "Srun", "find_mpiexec", "processor_slots",
           "register_resolvers"]


def register_resolvers() -> None:
    """Make each launcher module's interpolation resolvers (its RESOLVERS) known to OmegaConf (idempotent);
    bfexp.config asks for them on import, where a config may name them."""
    from omegaconf import OmegaConf

    for module in (emulated, srun):
        for name, resolver in module.RESOLVERS.items():
            if not OmegaConf.has_resolver(name):
                OmegaConf.register_new_resolver(name, resolver)

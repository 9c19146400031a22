"""Adds the opt-in start-up hook ``distcache-autoinstall.pth`` to the root of the
wheel (site-packages); everything else is declared in pyproject.toml. The hook does
nothing unless ``DISTCACHE_AUTOINSTALL=1``."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

STARTUP_HOOK = "distcache-autoinstall.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        self.copy_file(STARTUP_HOOK, str(Path(self.build_lib) / STARTUP_HOOK), preserve_mode=0)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib) / STARTUP_HOOK)]


setup(cmdclass={"build_py": BuildWithStartupHook})

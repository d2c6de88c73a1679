"""Build hook (the project's metadata is in pyproject.toml): the wheel carries ``conf/``.

``conf/`` lives at the repository root (the design card's layout), which an editable
install reads in place. A wheel (``pip install .``, as a cluster user installs moeexp)
has no repository root, so ``build_py`` copies ``conf/`` into the package as
``moeexp/conf/``; :mod:`moeexp.paths` uses that copy when it exists.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


class BuildPyWithConf(build_py):
    """``build_py`` + every file of ``conf/`` as package data ``moeexp/conf/**``."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:  # an editable install reads conf/ at the repository root
            return
        for src in sorted((ROOT / "conf").rglob("*")):
            if src.is_file() and "__pycache__" not in src.parts:
                dest = Path(self.build_lib) / "moeexp" / "conf" / src.relative_to(ROOT / "conf")
                self.mkpath(str(dest.parent))
                self.copy_file(str(src), str(dest))


setup(cmdclass={"build_py": BuildPyWithConf})

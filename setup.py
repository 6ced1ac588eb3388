"""Ship dsl/*.cll inside the wheel as hipress/dsl so installed copies find their algorithms."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class _BuildWithDsl(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # editable installs read dsl/ from the source tree
            return
        target = Path(self.build_lib) / "hipress" / "dsl"
        target.mkdir(parents=True, exist_ok=True)
        for src in sorted(Path(__file__).parent.joinpath("dsl").glob("*.cll")):
            shutil.copy2(src, target / src.name)


setup(cmdclass={"build_py": _BuildWithDsl})

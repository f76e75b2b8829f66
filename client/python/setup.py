"""setuptools glue for pyproject.toml: the wheel's kvrecall/v1 stubs are generated from proto/
at build time by gen_stubs.py (nothing generated is kept in git)."""
import os
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen_stubs  # noqa: E402


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        gen_stubs.generate(self.build_lib)
        init = os.path.join(self.build_lib, "kvrecall", "v1", "__init__.py")
        with open(init, "w") as f:
            f.write('"""kvrecall.v1: stubs generated from proto/kvrecall/v1/kvrecall.proto."""\n')


setup(cmdclass={"build_py": BuildWithStubs})

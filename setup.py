"""Install hook: asks op_builder which ops to prebuild (DS_BUILD_OPS / DS_BUILD_<OP>).

Default is no prebuild: ops JIT-build on first use. A prebuild needs torch in the build
environment, so install with `DS_BUILD_OPS=1 pip install --no-build-isolation .`.
"""

import os
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from op_builder.prebuild import prebuild_extensions  # noqa: E402  (stdlib-only import)

ext_modules, cmdclass = prebuild_extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)

"""Maps the top-level folders onto the ``grstack.*`` namespace (see docs/architecture.md §1).

``operator/`` must not shadow the standard library's ``operator`` module, so the folders are installed as
``grstack.operator``, ``grstack.runtime`` and ``grstack.kernels``; ``grstack`` itself is a namespace package.
"""

from setuptools import find_packages, setup

FOLDERS = ("operator", "runtime", "kernels")

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in FOLDERS:
    package_dir[f"grstack.{folder}"] = folder
    packages.append(f"grstack.{folder}")
    packages.extend(f"grstack.{folder}.{sub}" for sub in find_packages(folder))

setup(packages=packages, package_dir=package_dir)

"""Maps the top-level folders onto the ``grstack.*`` namespace (see docs/architecture.md §1).

``operator/`` must not shadow the standard library's ``operator`` module, so the folders are installed as
``grstack.operator``, ``grstack.runtime`` and ``grstack.kernels``; ``grstack`` itself is a namespace package.
The ready configs in ``configs/`` ship inside the wheel as ``grstack/configs/*.yaml``, next to
``grstack/runtime``, where :func:`grstack.runtime.config_files.config_dir` finds them (in a checkout it finds
the repository's ``configs/`` the same way).
"""

from setuptools import find_packages, setup

FOLDERS = ("operator", "runtime", "kernels")

packages: list[str] = []
package_dir: dict[str, str] = {}
for folder in FOLDERS:
    package_dir[f"grstack.{folder}"] = folder
    packages.append(f"grstack.{folder}")
    packages.extend(f"grstack.{folder}.{sub}" for sub in find_packages(folder))

# A data-only package (no __init__.py): the YAML files, nothing importable.
package_dir["grstack.configs"] = "configs"
packages.append("grstack.configs")

# The serving simulator's stored real runs (runtime/bench/serve_validation): its validation and the paper-scale
# profile's host costs read them, so an installed grstack carries them.
setup(packages=packages, package_dir=package_dir,
      package_data={"grstack.configs": ["*.yaml"],
                    "grstack.runtime.bench": ["serve_validation/*.json", "serve_validation/*/*.json",
                                              "serve_validation/*.json.gz", "serve_validation/*/*.json.gz"]})

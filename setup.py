"""Which packages the wheel holds, found from the folders on disk, so a new sub-package cannot be left out.

(A hand-kept list in pyproject.toml once missed ``fsdp_pass.train``: the editable install worked, a wheel did
not import. tests/test_wheel.py builds the wheel and imports every module from it.) Everything else about the
distribution is in pyproject.toml; pyproject's ``[tool.setuptools.packages.find]`` cannot rename a folder,
hence this file.

1. ``fsdp_pass`` and every package under it (each folder with an ``__init__.py``).
2. ``fsdp_pass_executors`` from the ``executors/`` folder (the project layout names the folder so; the import
   name cannot clash with PyPI's ``executors``), and any package under it.
"""

from setuptools import find_packages, setup

EXECUTORS_IMPORT_NAME, EXECUTORS_FOLDER = "fsdp_pass_executors", "executors"


def wheel_packages() -> list[str]:
    """Every import package the wheel holds, found in the folders."""
    ours = find_packages(include=["fsdp_pass", "fsdp_pass.*"])
    below_executors = [f"{EXECUTORS_IMPORT_NAME}.{name}" for name in find_packages(EXECUTORS_FOLDER)]
    return ours + [EXECUTORS_IMPORT_NAME, *below_executors]


setup(packages=wheel_packages(), package_dir={EXECUTORS_IMPORT_NAME: EXECUTORS_FOLDER})

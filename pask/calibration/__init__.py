"""Offline calibration of the PASK table: sensitivity floors, distortion-ranked upgrades, frozen table file.

Entry points: :func:`pask.calibration.calibrate.calibrate` (and ``calibrate_command`` /
``check_dev`` there), :func:`pask.policies.table.load`, :func:`pask.calibration.solver.solve`.
"""

from pask.policies.table import FORMAT_VERSION, FrozenTable, load

__all__ = ["FORMAT_VERSION", "FrozenTable", "load"]

"""Cost models: hardware profiles (data in ``conf/hardware``) and the roofline timing model."""

from moeexp.costmodel.hardware import HardwareProfile, available_profiles, load_profile
from moeexp.costmodel.roofline import CostModel

__all__ = ["CostModel", "HardwareProfile", "available_profiles", "load_profile"]

from sb3_influence.a2c.influence_a2c import InfluenceA2C
from sb3_influence.a2c.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["CnnPolicy", "InfluenceA2C", "MlpPolicy", "MultiInputPolicy"]

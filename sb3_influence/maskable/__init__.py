from sb3_influence.maskable.buffers import InfluenceMaskableDictRolloutBuffer, InfluenceMaskableRolloutBuffer
from sb3_influence.maskable.influence_maskable_ppo import InfluenceMaskablePPO
from sb3_influence.maskable.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = [
    "CnnPolicy",
    "InfluenceMaskableDictRolloutBuffer",
    "InfluenceMaskablePPO",
    "InfluenceMaskableRolloutBuffer",
    "MlpPolicy",
    "MultiInputPolicy",
]

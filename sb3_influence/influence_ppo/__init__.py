from sb3_influence.influence_ppo.influence_ppo import InfluencePPO
from sb3_influence.influence_ppo.policies import CnnPolicy, MlpPolicy, MultiInputPolicy

__all__ = ["CnnPolicy", "InfluencePPO", "MlpPolicy", "MultiInputPolicy"]

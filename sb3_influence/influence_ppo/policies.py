# InfluencePPO trains SB3's own actor-critic policies: the influence engine needs nothing from the policy
# beyond ``pi_features_extractor``, ``mlp_extractor.forward_actor`` and ``_get_action_dist_from_latent``.
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy, MultiInputActorCriticPolicy

MlpPolicy = ActorCriticPolicy
CnnPolicy = ActorCriticCnnPolicy
MultiInputPolicy = MultiInputActorCriticPolicy

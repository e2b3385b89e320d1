# InfluenceMaskablePPO trains sb3-contrib's maskable actor-critic policies: the influence engine needs nothing from
# them beyond ``pi_features_extractor``, ``mlp_extractor.forward_actor``, ``_get_action_dist_from_latent`` and the
# distribution's ``apply_masking``.
from sb3_contrib.common.maskable.policies import (
    MaskableActorCriticCnnPolicy,
    MaskableActorCriticPolicy,
    MaskableMultiInputActorCriticPolicy,
)

MlpPolicy = MaskableActorCriticPolicy
CnnPolicy = MaskableActorCriticCnnPolicy
MultiInputPolicy = MaskableMultiInputActorCriticPolicy

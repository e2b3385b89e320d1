"""Features extractors of the paper's experiments."""

import gymnasium as gym
import torch as th
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn


class MiniGridCNN(BaseFeaturesExtractor):
    """
    The CNN of the paper's MiniGrid experiments (Sec. 5 and its appendix), for ``ImgObsWrapper`` observations (7x7x3,
    transposed to channels-first by SB3): Conv(3→16, 3x3) → ReLU → Conv(16→32, 3x3) → ReLU → Flatten (288)
    → Linear(288→``features_dim``) → ReLU.

    Use it with ``policy_kwargs=dict(features_extractor_class=MiniGridCNN, net_arch=dict(pi=[64, 64], vf=[64, 64]))``.

    :param observation_space: A channels-first image space ``(C, H, W)`` with ``H, W >= 5``.
    :param features_dim: Size of the output features.
    """

    def __init__(self, observation_space: gym.Space, features_dim: int = 64):
        if not isinstance(observation_space, gym.spaces.Box) or len(observation_space.shape) != 3:
            raise ValueError(
                f"MiniGridCNN needs an image observation space of shape (C, H, W), got {observation_space}: "
                "wrap MiniGrid envs with minigrid.wrappers.ImgObsWrapper"
            )
        n_channels, height, width = observation_space.shape
        if height < 5 or width < 5:
            raise ValueError(f"MiniGridCNN needs images of at least 5x5 (two 3x3 convolutions), got {height}x{width}")
        super().__init__(observation_space, features_dim)
        self.cnn = nn.Sequential(
            nn.Conv2d(n_channels, 16, kernel_size=3),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3),
            nn.ReLU(),
            nn.Flatten(),
        )
        n_flatten = 32 * (height - 4) * (width - 4)
        self.linear = nn.Sequential(nn.Linear(n_flatten, features_dim), nn.ReLU())

    def forward(self, observations: th.Tensor) -> th.Tensor:
        return self.linear(self.cnn(observations))

"""Scoring: the engine (per-layer ghost dot products and forward mode) and the scorers built on it."""

from sb3_influence.common.scoring.engine import ENGINE_MODES, InfluenceEngine
from sb3_influence.common.scoring.layers import DEFAULT_LAYER_SCORERS, ConvScorer, LayerScorer, LinearScorer

__all__ = ["DEFAULT_LAYER_SCORERS", "ENGINE_MODES", "ConvScorer", "InfluenceEngine", "LayerScorer", "LinearScorer"]

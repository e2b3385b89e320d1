"""``python -m sb3_influence.zoo``: the same as ``sb3-influence-zoo``."""

import sys

from sb3_influence.zoo.launcher import main

sys.exit(main())

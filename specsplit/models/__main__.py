"""``python -m specsplit.models pull|path ...``"""

import sys

from specsplit.models.cli import models_main

if __name__ == "__main__":
    sys.exit(models_main(sys.argv[1:]))

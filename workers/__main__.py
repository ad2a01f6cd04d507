import sys

from gpuq.workers.main import main

sys.exit(main())

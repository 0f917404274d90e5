import sys

from livemig.coordinator.coordinator import main

sys.exit(main())

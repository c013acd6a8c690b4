"""Until the monitor and worker exist, the demo runs the local stack alone."""
from devstack.__main__ import main

main()

from sokutatsu.monitor.server import main

main()

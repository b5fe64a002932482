from sokutatsu.queuedb.server import main

main()

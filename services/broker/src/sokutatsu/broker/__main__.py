from sokutatsu.broker.server import main

main()

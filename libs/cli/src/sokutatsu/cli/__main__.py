from sokutatsu.cli.app import main

main()

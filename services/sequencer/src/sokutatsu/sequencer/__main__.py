from sokutatsu.sequencer.server import main

main()

from harness.nemesis.proxy import main

main()

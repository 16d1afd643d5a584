set terminal pngcairo size 900,600 font 'Sans,10'
set output 'docs/results/openllama-3b-h200x2/run-microbatch2/speedup_vs_nodes.png'
set title 'Speedup over 1 node(s)'
set xlabel 'nodes'
set ylabel 'speedup'
set grid
set key top left
set xtics 1
plot 'docs/results/openllama-3b-h200x2/run-microbatch2/plots/by_nodes.dat' index 0 using 1:2 with linespoints lw 2 pt 7 title 'load=8'
